#!/usr/bin/env bash
# Fuzzes the decoders of untrusted bytes for N seconds in all (default 90), split evenly
# between the targets named after it (default: both):
#   ring_envelope  the command-channel reader (ring + envelope decoder)
#   layout_header  the header and tensor-table validation
# Long runs count executions instead: `bash scripts/fuzz.sh --runs 10000000 [target...]`
# runs each target for that many (one target at a time; hours on a small machine; run it
# under `nice`), and prints each one's count, time and peak memory.
# A crash leaves its input in fuzz/artifacts/TARGET/: once fixed, copy it into
# fuzz/regressions/ (ring_envelope) or tests/hostile_headers/ (layout_header) so
# `cargo test` replays it for good.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
runs=""
if [ "${1:-}" = "--runs" ]; then
    runs="${2:?--runs needs a number of executions}"
    shift 2
    secs=0
else
    secs="${1:-90}"
    [ $# -gt 0 ] && shift
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(ring_envelope layout_header)
per=$((secs / ${#targets[@]}))
[ "$per" -gt 0 ] || per=1
if [ -n "$runs" ]; then
    limit=(-runs="$runs")
else
    limit=(-max_total_time="$per")
fi

# With a nightly toolchain: libFuzzer under AddressSanitizer. Without one (Debian's
# rustc, or rustup's stable alone): the same libFuzzer and coverage instrumentation, no
# sanitizer. Stable rustc takes cargo fuzz's -Z flags only under RUSTC_BOOTSTRAP=1; what
# is fuzzed is Rust whose unsafe code is a few audited reads, and a panic, an abort or a
# blown allocation limit is still a crash found.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fuzz=(cargo +nightly fuzz run)
    mode="nightly toolchain, AddressSanitizer"
else
    fuzz=(env RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none)
    mode="$(rustc --version | awk '{print $1, $2}') (no nightly here), no sanitizer"
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --quiet
fi

for target in "${targets[@]}"; do
    corpus=fuzz/corpus/$target
    mkdir -p "$corpus"
    case "$target" in
        ring_envelope) cp fuzz/regressions/*.bin "$corpus"/ ;;
        layout_header)
            cp tests/hostile_headers/*.bin "$corpus"/
            # Valid headers (raw snapshots and unedited builder output), written by the
            # test that checks them; built with the features of scripts/test.sh's
            # `cargo test`, so there it reuses that build.
            SHMBRIDGE_HEADER_CORPUS="$corpus" cargo test --locked --quiet --features cuda,vulkan \
                --test hostile_headers corpus_seeds_are_valid_headers >/dev/null
            ;;
        *)
            echo "fuzz: unknown target '$target' (ring_envelope, layout_header)" >&2
            exit 2
            ;;
    esac
    log=/tmp/shmbridge-fuzz-$target.log
    if [ -n "$runs" ]; then
        echo "fuzz: $target for $runs executions (commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $mode)"
    else
        echo "fuzz: $target for $per s ($mode)"
    fi
    started=$(date +%s)
    # The fuzzer's own status, not the filter's: with pipefail, `|| true` would hide a crash.
    set +e +o pipefail
    "${fuzz[@]}" "$target" "$corpus" -- \
        "${limit[@]}" -rss_limit_mb=2048 -print_final_stats=1 2>&1 \
        | tee "$log" | grep -E '^(#[0-9]+ +DONE|Done|stat::number_of_executed_units|stat::peak_rss|==[0-9]+==|SUMMARY)'
    status=${PIPESTATUS[0]}
    set -e -o pipefail
    echo "fuzz: $target ran $(( $(date +%s) - started )) s"
    if [ "$status" -ne 0 ]; then
        echo "fuzz: $target failed (exit $status); see $log and fuzz/artifacts/$target/" >&2
        exit "$status"
    fi
done
