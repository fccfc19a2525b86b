# Shared by the scripts: make sure the tools the project builds with are here.
# Sourced, not run.

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: installing Debian's Rust toolchain" >&2
        as_root apt-get update -q
        as_root apt-get install -y -q cargo rustc
    fi
    # The crate needs Rust >= 1.82 (see rust-version in Cargo.toml).
    local v
    v=$(rustc --version | awk '{print $2}')
    if [ "$(printf '%s\n1.82.0\n' "$v" | sort -V | head -n1)" != "1.82.0" ]; then
        echo "error: rustc $v is older than 1.82; install a newer toolchain (rustup)" >&2
        exit 1
    fi
    # C compiler for build scripts; C++ for libFuzzer (cargo fuzz) and the GPU kernel
    # compiled for the host (tests/cartpole_kernel.rs).
    if ! command -v cc >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
        as_root apt-get update -q
        as_root apt-get install -y -q gcc g++
    fi
}

# A virtual environment in .venv with the package built from this checkout and what
# its tests need. Prints nothing on success but pip's errors.
ensure_venv() {
    if ! python3 -m venv --help >/dev/null 2>&1; then
        as_root apt-get update -q
        as_root apt-get install -y -q python3 python3-venv python3-pip
    fi
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$@"
}

# A Vulkan loader and Mesa's CPU driver lavapipe, so the Vulkan tests (tests/vulkan.rs)
# run on a machine without a GPU.
ensure_vulkan() {
    if [ ! -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] && \
       [ ! -e /usr/share/vulkan/icd.d/lvp_icd.aarch64.json ]; then
        as_root apt-get update -q
        as_root apt-get install -y -q mesa-vulkan-drivers libvulkan1
    fi
}

# Debian's Mono C# compiler and runtime, so the C# binding and engine
# (bindings/csharp, examples/csharp) build and run in the tests. Mono 6.8's mscorlib has
# Span<T>: nothing from another registry is needed.
ensure_mono() {
    if ! command -v mcs >/dev/null 2>&1 || ! command -v mono >/dev/null 2>&1; then
        as_root apt-get update -q
        as_root apt-get install -y -q mono-mcs mono-runtime
    fi
}

# Debian's headless-capable Chromium and its WebDriver, so the viewer's browser test
# (tests/python/test_view.py, selenium from the test extra) drives a real browser.
ensure_chromium() {
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        as_root apt-get update -q
        as_root apt-get install -y -q chromium chromium-driver
    fi
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
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
