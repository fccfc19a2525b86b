# Shared by the scripts: make sure the tools the project builds with are here.
# Sourced, not run.

# A command that fails under `set -e` says which it was and where, once, before the script
# exits (without this, a failure in a sourced function or a command substitution ends the
# script with nothing said). -E: functions and subshells (the lanes) inherit the trap.
set -E
trap '_on_error $? "$BASH_COMMAND" "${BASH_SOURCE[0]:-?}" "$LINENO"' ERR
_on_error() {
    if [ -z "${_ERROR_SHOWN:-}" ]; then
        _ERROR_SHOWN=1
        echo "error: $3:$4: \`$2\` exited with status $1" >&2
    fi
}

# `step TEXT` starts a step of a script: prints "== [T s] TEXT", T the seconds since the
# script started (bash's SECONDS), so a log shows where the time went; `part TEXT` does the
# same for a part of a step ("-- [T s] TEXT"). `steps_summary` prints each one's wall time
# and the CPU time (user + system) of the processes that ended within it: a background job
# (start_deps, lane_start) counts in the step during which it ended (the shell reaps it
# then), and a lane's own table gives its steps' figures.
STEP_NAMES=()
STEP_STARTS=()
STEP_CPU=()
STEPS_ORIGIN=0
step() {
    _step_mark "$*"
    printf '== [%4d s] %s\n' "$SECONDS" "$*"
}
part() {
    _step_mark "  $*"
    printf -- '-- [%4d s] %s\n' "$SECONDS" "$*"
}
_step_mark() {
    _children_cpu
    STEP_NAMES+=("$1")
    STEP_STARTS+=("$SECONDS")
    STEP_CPU+=("$CHILDREN_CPU")
}
# CHILDREN_CPU: the user + system time, in clock ticks, of this shell's children that have
# ended (and theirs): fields 16 and 17 of /proc/PID/stat, read by the shell itself (or by
# the subshell of a lane: BASHPID, not $$).
_children_cpu() {
    local stat fields
    read -r stat < "/proc/$BASHPID/stat"
    read -ra fields <<< "${stat##*) }"
    CHILDREN_CPU=$((fields[13] + fields[14]))
}
steps_summary() {
    local i j end cpu_end n=${#STEP_NAMES[@]} hz
    hz=$(getconf CLK_TCK)
    _children_cpu
    echo "wall and CPU seconds per step (a step's figures include its parts; a background lane's CPU counts in the step during which it ended; load: $(cut -d' ' -f1-3 /proc/loadavg)):"
    printf '%6s %6s  %s\n' wall cpu step
    for ((i = 0; i < n; i++)); do
        end=$SECONDS
        cpu_end=$CHILDREN_CPU
        for ((j = i + 1; j < n; j++)); do
            # A part ends where the next entry starts; a step where the next step does.
            if [ "${STEP_NAMES[i]:0:2}" = "  " ] || [ "${STEP_NAMES[j]:0:2}" != "  " ]; then
                end=${STEP_STARTS[j]}
                cpu_end=${STEP_CPU[j]}
                break
            fi
        done
        printf '%6d %6s  %s\n' $((end - STEP_STARTS[i])) "$(_ticks_as_seconds $((cpu_end - STEP_CPU[i])) "$hz")" \
            "${STEP_NAMES[i]:0:100}"
    done
    printf '%6d %6s  in all\n' $((SECONDS - STEPS_ORIGIN)) "$(_ticks_as_seconds "$CHILDREN_CPU" "$hz")"
}

# `lane_start NAME FUNCTION`: runs FUNCTION, a function of the calling script, in the
# background, beside the steps that follow (so that one core's wait, a single-threaded
# step or a download, is the other's work). Its output goes to target/lanes/NAME.log, its
# steps are timed as the script's are, and it ends with their table. `lane_join NAME`
# waits for it, prints that log, and fails where the lane failed; `lanes_stop` (for an
# EXIT trap) ends the lanes still running, with all they started. A lane is a process
# group of its own (set -m), so it keeps SIGINT at its default (a background job of a
# shell without job control would ignore it, and so would its tests' peers) and can be
# ended as a whole. Where two lanes need one cargo lock (a profile folder) at once, the
# second waits for it.
declare -A LANE_PIDS=()
lane_start() {
    local name=$1 fn=$2
    mkdir -p target/lanes
    printf -- '-- [%4d s] lane %s starts in the background (target/lanes/%s.log)\n' "$SECONDS" "$name" "$name"
    set -m
    # stdin from /dev/null: with job control a background job keeps the script's, and one
    # that read the terminal would be stopped, and lane_join would wait for it forever.
    (
        set +m
        STEP_NAMES=()
        STEP_STARTS=()
        STEP_CPU=()
        STEPS_ORIGIN=$SECONDS
        trap steps_summary EXIT
        "$fn"
    ) < /dev/null > "target/lanes/$name.log" 2>&1 &
    LANE_PIDS[$name]=$!
    set +m
}
# SIGTERM to each lane's process group, then, after a bounded wait (5 s) for it to go,
# SIGKILL. A SIGKILL of the script itself leaves the lanes to whoever sent it (a CI
# runner ends the whole job).
lanes_stop() {
    local name pgid i
    for name in "${!LANE_PIDS[@]}"; do
        pgid=${LANE_PIDS[$name]}
        kill -TERM -- "-$pgid" 2>/dev/null || continue
        for ((i = 0; i < 50; i++)); do
            kill -0 -- "-$pgid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL -- "-$pgid" 2>/dev/null || true
        echo "lane $name stopped (target/lanes/$name.log)" >&2
    done
}
lane_join() {
    local name=$1 status=0
    wait "${LANE_PIDS[$name]}" || status=$?
    unset "LANE_PIDS[$name]"
    printf -- '-- [%4d s] lane %s ended (status %d); its output:\n' "$SECONDS" "$name" "$status"
    sed 's/^/   | /' "target/lanes/$name.log"
    if [ "$status" -ne 0 ]; then
        echo "error: lane $name failed (above)" >&2
        exit 1
    fi
}
_ticks_as_seconds() {
    local tenths=$(($1 * 10 / $2))
    echo "$((tenths / 10)).$((tenths % 10))"
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
ensure_chromium() {
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        apt_install chromium chromium-driver
    fi
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# `with_private_shm CMD...`: runs CMD in a mount namespace of its own with an empty tmpfs
# on /dev/shm (root: unshare -m), and fails if CMD left a shmbridge region or fd socket
# there; where that cannot be made (not root), CMD runs as it is. scripts/test.sh runs
# what makes regions beside pytest this way (pytest's tests compare the regions in
# /dev/shm before and after), and scripts/soak.sh the soak.
can_private_shm() {
    [ "$(id -u)" = 0 ] && command -v unshare >/dev/null 2>&1
}
with_private_shm() {
    if ! can_private_shm; then
        echo "with_private_shm: not root (or no unshare): \"$*\" runs on this machine's /dev/shm" >&2
        "$@"
        return
    fi
    # As large as the machine's own /dev/shm, so a command runs out of room where it would.
    local size
    size=$(df -k --output=size /dev/shm | tail -n1 | tr -d ' ')
    SHM_SIZE_KIB=$size unshare -m --propagation private sh -c '
        mount -t tmpfs -o "size=${SHM_SIZE_KIB}k,mode=1777" shmbridge-private /dev/shm || exit 1
        status=0
        "$@" || status=$?
        left=$(ls /dev/shm | grep "^shmbridge" || true)
        if [ -n "$left" ]; then
            echo "error: left in /dev/shm by \"$*\": $left" >&2
            [ "$status" -ne 0 ] || status=1
        fi
        exit "$status"' sh "$@"
}

# Whether this machine has an NVIDIA GPU (its control device): then scripts/test.sh runs
# nothing beside the tests that use it.
gpu_present() {
    [ -e /dev/nvidiactl ]
}

# Names of shmbridge regions in /dev/shm, one per line.
shm_regions() {
    ls /dev/shm 2>/dev/null | grep '^shmbridge' || true
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
