#!/usr/bin/env bash
# Fuzzes the command-channel reader (ring + envelope decoder) for N seconds (default 60).
# A crash leaves its input in fuzz/artifacts/ring_envelope/: once fixed, copy it into
# fuzz/regressions/ so `cargo test` replays it for good.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
secs="${1:-60}"

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "fuzz: cargo fuzz needs a nightly toolchain and this machine has none (rustup toolchain install nightly)" >&2
    exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --quiet
fi
corpus=fuzz/corpus/ring_envelope
mkdir -p "$corpus"
cp fuzz/regressions/*.bin "$corpus"/
cargo +nightly fuzz run ring_envelope "$corpus" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 2>&1 \
    | tee /tmp/shmbridge-fuzz.log | grep -E '^(#[0-9]+ +DONE|Done|stat::number_of_executed_units|stat::peak_rss|==[0-9]+==|SUMMARY)' || true
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    echo "fuzz: the target failed (exit $status); see /tmp/shmbridge-fuzz.log and fuzz/artifacts/" >&2
    exit "$status"
fi
