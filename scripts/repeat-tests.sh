#!/usr/bin/env bash
# Every test file run many times over beside busy loops: the check that no test is flaky
# on a loaded machine. Run scripts/test.sh first (this reuses its build, its test venv and
# its C library), then:
#
#   scripts/repeat-tests.sh [--count N] [--busy B] [rust] [python]
#
# N runs of each test (default 20) while B processes spin on the CPU (default 2):
#   rust     cargo nextest's stress mode: the whole Rust suite (unit, integration, CLI)
#            N times over; each iteration's failures are printed with their test names.
#   python   every tests/python file N times (pytest-repeat's --count) under pytest-xdist.
# Ends with a line per language, "rust: F failed of T test runs", and exits 1 if any
# failed. The logs stay in target/repeat/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

count=20 busy=2 parts=()
while [ $# -gt 0 ]; do
    case "$1" in
        --count) count=$2; shift 2 ;;
        --busy) busy=$2; shift 2 ;;
        rust | python) parts+=("$1"); shift ;;
        *) echo "usage: $0 [--count N] [--busy B] [rust] [python]" >&2; exit 2 ;;
    esac
done
[ ${#parts[@]} -gt 0 ] || parts=(rust python)
export SHMBRIDGE_NAMESPACE="${SHMBRIDGE_NAMESPACE:-rep$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')}"
mkdir -p target/repeat

loops=()
stop_loops() { [ ${#loops[@]} -eq 0 ] || kill "${loops[@]}" 2>/dev/null || true; }
trap stop_loops EXIT
for _ in $(seq "$busy"); do
    sh -c 'while :; do :; done' &
    loops+=($!)
done
echo "repeat-tests: $count runs of each test beside $busy busy loops (pids ${loops[*]:-none}), region namespace $SHMBRIDGE_NAMESPACE"

failed=0
for part in "${parts[@]}"; do
    log=target/repeat/$part.log
    step "$part: every test $count times"
    status=0
    case "$part" in
        rust)
            export SHMBRIDGE_REQUIRE_NVRTC=1
            use_nvrtc_wheel target/test-venv/bin/python
            cargo nextest run --locked --features cuda,vulkan --lib --bins --tests \
                --stress-count "$count" --no-fail-fast > "$log" 2>&1 || status=$?
            # nextest's line per iteration: "... iteration i/N: T tests run: P passed, ..."
            runs=$(grep -oE 'iteration [0-9]+/[0-9]+: [0-9]+ tests run' "$log" \
                | awk '{s += $3} END {print s + 0}')
            bad=$(grep -E '^ +(FAIL|SIGSEGV|SIGABRT|SIGBUS|TIMEOUT)' "$log" || true)
            ;;
        python)
            target/test-venv/bin/python -c 'import pytest_repeat' 2>/dev/null \
                || target/test-venv/bin/python -m pip install -q "pytest-repeat==0.9.4"
            export SHMBRIDGE_C_PREFIX=$PWD/target/c-prefix SHMBRIDGE_EXPECT_WHEEL=1
            without_rust target/test-venv/bin/python -m pytest -q -rf -n auto -p no:cacheprovider \
                --count "$count" --ignore tests/python/test_gpu.py tests/python > "$log" 2>&1 || status=$?
            runs=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 \
                | grep -oE '[0-9]+ (passed|failed|skipped|error)' | awk '{s += $1} END {print s + 0}')
            bad=$(grep -E '^(FAILED|ERROR) ' "$log" || true)
            ;;
    esac
    nbad=$(printf '%s' "$bad" | grep -c . || true)
    [ -z "$bad" ] || printf '%s\n' "$bad" | sort | uniq -c
    echo "$part: $nbad failed of $runs test runs ($count each; exit status $status; log $log)"
    if [ "$status" -ne 0 ] || [ "$nbad" -ne 0 ]; then
        failed=1
    fi
done
exit "$failed"
