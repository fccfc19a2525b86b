#!/usr/bin/env bash
# Every check that needs a GPU, in one command, for a machine with an NVIDIA GPU and
# driver: the Rust GPU tests (tests/cuda.rs), the Python GPU tests (test_gpu, and the GPU
# tests of test_ppo and test_bench), the Vulkan tests with the CUDA importer and `bench
# vulkan`, `python -m shmbridge.bench gpu`, the GPU tests again under compute-sanitizer
# where the machine has it, and PPO at 4096 envs on CUDA: zero copy (--device cuda) and
# host-staged (--host-staged), each to the 475 target. Unlike scripts/test.sh, a GPU
# test that skips here is a failure: on a GPU machine they must run. The rust-cuda step
# covers both ways CUDA memory is shared: CUDA IPC (another_process_sees_the_bytes, the
# engine tests) and memory shared by fd (fd_memory_round_trip_and_export,
# fd_import_refuses_impostors_and_oversized_spans, and
# fd_memory_crosses_processes_and_pid_namespaces, whose importer runs in a PID namespace
# of its own, as a learner in another container: it needs `unshare`), the engine and
# client serving and importing it over the region's fd socket (protocol 1.9:
# cuda_fd_sharing_engine_and_client_lock_step_across_pid_namespaces, the engine once in
# a PID namespace of its own), and the refusal of IPC handles across PID namespaces at
# attach (cuda_ipc_handles_of_an_engine_in_another_pid_namespace_are_refused_at_attach).
#
#   bash scripts/gpu-check.sh [--bundle DIR] [--only STEP,...] [OUT]
#   --bundle DIR  on a machine with a driver, python3 with torch and pytest, and nothing
#                 else (no Rust, no network): uses what `bash scripts/gpu-bundle.sh DIR`
#                 built elsewhere. Without it: builds, and uses .venv as scripts/test.sh
#                 leaves it.
#   --only        these steps alone (to split the work over several shorter commands):
#                 rust-cuda, python-gpu, rust-vulkan, bench-vulkan, bench-gpu,
#                 sanitizer-rust-cuda, ppo-cuda, ppo-host-staged
#
# Logs, benchmark tables and plots go to OUT (default bench-results/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

steps="rust-cuda python-gpu rust-vulkan bench-vulkan bench-gpu sanitizer-rust-cuda ppo-cuda ppo-host-staged"
bundle=""
only=""
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) bundle="${2:?--bundle needs the folder scripts/gpu-bundle.sh wrote}"; shift 2 ;;
        --only)
            only=",${2:?--only needs step names, comma-separated},"
            for name in ${2//,/ }; do
                [[ " $steps " == *" $name "* ]] || { echo "gpu-check: no step '$name' (steps: $steps)" >&2; exit 2; }
            done
            shift 2
            ;;
        -*) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$out" ] || { echo "gpu-check: one OUT folder, not '$out' and '$1'" >&2; exit 2; }; out=$1; shift ;;
    esac
done
out=${out:-bench-results/gpu-check}
mkdir -p "$out"
out=$(realpath "$out")

nvidia-smi || { echo "gpu-check: nvidia-smi failed: no usable NVIDIA driver here" >&2; exit 3; }

if [ -n "$bundle" ]; then
    bundle=$(realpath "$bundle")
    export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"  # ldconfig
    # Vulkan and EGL loaders, where the machine has none (the NVIDIA ICD is the driver's).
    if ! ldconfig -p | grep -q 'libvulkan.so.1 '; then
        for f in "$bundle"/debs/*.deb; do dpkg -x "$f" /; done
        ldconfig
    fi
    if [ -z "${VK_DRIVER_FILES:-}" ] && [ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
        export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    fi
    site=/tmp/shmbridge-site
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$bundle"/wheels/*.whl
    # The NVRTC wheel's `nvidia/__init__.py` would hide the machine's own `nvidia`
    # namespace (torch's CUDA libraries) from imports: a namespace portion merges with it.
    rm -f "$site/nvidia/__init__.py"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # tests/common's BIN: the CLI where the Rust tests were compiled to look for it.
    install -D -m 755 "$bundle/bin/shmbridge" "$(cat "$bundle/bin/cli-path")"
    py=python3
    rust_cuda=("$bundle/bin/cuda")
    rust_vulkan=("$bundle/bin/vulkan")
    # Needs a toolchain (cargo builds the C library): CI runs it on every commit.
    pytest_skip=(--deselect tests/python/test_ppo.py::test_ppo_trains_on_the_c_engine_exactly_as_on_the_reference_one)
else
    ensure_rust
    [ -x .venv/bin/python ] || ensure_venv ".[test,bench]"
    py=.venv/bin/python
    rust_cuda=(cargo test --locked --features cuda --test cuda --)
    rust_vulkan=(cargo test --locked --features cuda,vulkan --test vulkan --)
    pytest_skip=()
fi

use_nvrtc_wheel $py
$py -c 'import shmbridge, torch; print("shmbridge", shmbridge.__version__, "cuda_status():", shmbridge.cuda_status(), "| torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU for torch")'

failed=()
# Runs one step, its output also in $out/NAME.log; a GPU skip in it is a failure.
step() {
    local name=$1 skip_pattern=$2
    shift 2
    if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then
        return 0
    fi
    echo "== $name"
    set +e +o pipefail
    "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    set -e -o pipefail
    if [ "$status" -ne 0 ]; then
        failed+=("$name (exit $status)")
    elif [ -n "$skip_pattern" ] && grep -E "$skip_pattern" "$out/$name.log" | grep -v 'checks the fallback'; then
        failed+=("$name (a GPU test skipped)")
    fi
}

step rust-cuda 'SKIPPED' "${rust_cuda[@]}" --nocapture --test-threads=1
step python-gpu '^SKIPPED .*(CUDA|GPU|cuda|gpu)' $py -m pytest -rs -v "${pytest_skip[@]}" \
    tests/python/test_gpu.py tests/python/test_ppo.py tests/python/test_bench.py
step rust-vulkan 'SKIPPED' "${rust_vulkan[@]}" --nocapture --test-threads=1
step bench-vulkan 'GPU half: not run|bench vulkan: skipped' $py -m shmbridge.bench vulkan --out "$out"
step bench-gpu '' $py -m shmbridge.bench gpu --out "$out"
if command -v compute-sanitizer >/dev/null 2>&1; then
    # The exporting and importing processes are both children of the test binary.
    step sanitizer-rust-cuda '' compute-sanitizer --tool memcheck --target-processes all \
        --error-exitcode 9 "${rust_cuda[@]}" --test-threads=1
elif [[ "$only" == *",sanitizer-rust-cuda,"* ]]; then
    failed+=("sanitizer-rust-cuda (asked for, and compute-sanitizer is not on this machine)")
else
    echo "== compute-sanitizer: not on this machine"
fi
# Each run to the 475 target: one that stops short of it fails the step.
ppo=($py -m shmbridge.examples.ppo --num-envs 4096 --num-steps 16 --total-steps 20000000 --threads 0)
step ppo-cuda 'target .* not reached' "${ppo[@]}" --device cuda --plot "$out/ppo_cuda.png"
step ppo-host-staged 'target .* not reached' "${ppo[@]}" --device cuda --host-staged \
    --plot "$out/ppo_host_staged.png"

echo "== results in $out"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu-check: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "gpu-check: every GPU check passed"
