#!/usr/bin/env bash
# Every test: unit, integration (cross-process, 1M-step stress, hostile headers, peer
# death), property, the loom model of the wait handshake, a smoke run of the benchmark,
# and a check that nothing was left in /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust

before=$(shm_regions)

echo "== cargo test"
cargo test --locked

echo "== loom model of the post/wait handshake"
LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test --locked --release --lib sync::loom_tests

echo "== benchmark smoke run (no timing is checked)"
SHMBRIDGE_BENCH_QUICK=1 cargo bench --locked --bench roundtrip

echo "== nothing left in /dev/shm"
after=$(shm_regions)
leaked=$(comm -13 <(echo "$before" | sort) <(echo "$after" | sort) | grep . || true)
if [ -n "$leaked" ]; then
    echo "error: the tests left these regions in /dev/shm:" >&2
    echo "$leaked" >&2
    exit 1
fi
echo "no region left"
