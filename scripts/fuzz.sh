#!/usr/bin/env bash
# Fuzzes the decoders of untrusted bytes for N seconds of fuzzing in all (default 90),
# split evenly between the targets named after it (default: all three), which run side by
# side, one core each, where the machine has a core for each (else one after another):
#   ring_envelope  the command-channel reader (ring + envelope decoder)
#   layout_header  the header and tensor-table validation
#   stream_record  a stream consumer's record decoding and its header validation
# Long runs count executions instead: `bash scripts/fuzz.sh --runs 10000000 [target...]`
# runs each target for that many (one target at a time; hours on a small machine; run it
# under `nice`), and prints each one's count, time and peak memory.
# `bash scripts/fuzz.sh --build [target...]` only builds them (scripts/test.sh builds them,
# then runs them).
# A crash leaves its input in fuzz/artifacts/TARGET/: once fixed, copy it into
# fuzz/regressions/ (ring_envelope), tests/hostile_headers/ (layout_header) or
# fuzz/stream_regressions/ (stream_record) so
# `cargo test` replays it for good.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
runs=""
build_only=""
if [ "${1:-}" = "--build" ]; then
    build_only=1
    shift
    secs=0
elif [ "${1:-}" = "--runs" ]; then
    runs="${2:?--runs needs a number of executions}"
    shift 2
    secs=0
else
    secs="${1:-90}"
    [ $# -gt 0 ] && shift
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(ring_envelope layout_header stream_record)
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
    fuzz=(cargo +nightly fuzz)
    fuzz_opts=()
    mode="nightly toolchain, AddressSanitizer"
else
    fuzz=(env RUSTC_BOOTSTRAP=1 cargo fuzz)
    fuzz_opts=(--sanitizer none)
    mode="$(rustc --version | awk '{print $1, $2}') (no nightly here), no sanitizer"
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --quiet
fi
ensure_libfuzzer
if [ -n "${CUSTOM_LIBFUZZER_PATH:-}" ]; then
    mode="$mode, libFuzzer from ${CUSTOM_LIBFUZZER_PATH#/usr/lib/}"
else
    mode="$mode, libFuzzer built from libfuzzer-sys's sources"
fi
for target in "${targets[@]}"; do
    case "$target" in
        ring_envelope | layout_header | stream_record) ;;
        *)
            echo "fuzz: unknown target '$target' (ring_envelope, layout_header, stream_record)" >&2
            exit 2
            ;;
    esac
done
if [ -n "$build_only" ]; then
    echo "fuzz: building ${targets[*]} ($mode)"
    for target in "${targets[@]}"; do
        "${fuzz[@]}" build "${fuzz_opts[@]}" "$target"
    done
    exit 0
fi

for target in "${targets[@]}"; do
    corpus=fuzz/corpus/$target
    mkdir -p "$corpus"
    case "$target" in
        ring_envelope) cp fuzz/regressions/*.bin "$corpus"/ ;;
        stream_record) cp fuzz/stream_regressions/*.bin "$corpus"/ ;;
        layout_header)
            cp tests/hostile_headers/*.bin "$corpus"/
            # Valid headers (raw snapshots and unedited builder output), written by the
            # test that checks them; built with the features of scripts/test.sh's
            # `cargo test`, so there it reuses that build.
            SHMBRIDGE_HEADER_CORPUS="$corpus" cargo test --locked --quiet --features cuda,vulkan \
                --test hostile_headers corpus_seeds_are_valid_headers >/dev/null
            ;;
    esac
    # Built before any runs, so that targets run side by side start together.
    "${fuzz[@]}" build "${fuzz_opts[@]}" "$target"
done

# Runs the fuzzer on TARGET, its output in target/fuzz-logs/TARGET.log (this clone's: two
# runs on one machine keep apart); writes its exit status and seconds to the .status file
# beside it.
logs=$PWD/target/fuzz-logs
mkdir -p "$logs"
run_target() {
    local target=$1 started status=0
    started=$(date +%s)
    "${fuzz[@]}" run "${fuzz_opts[@]}" "$target" "fuzz/corpus/$target" -- \
        "${limit[@]}" -rss_limit_mb=2048 -print_final_stats=1 \
        > "$logs/$target.log" 2>&1 || status=$?
    echo "$status $(( $(date +%s) - started ))" > "$logs/$target.status"
}
# Prints what TARGET's run found and how long it took; fails with its status.
report_target() {
    local target=$1 log=$logs/$1.log status secs
    grep -E '^(#[0-9]+ +DONE|Done|stat::number_of_executed_units|stat::peak_rss|==[0-9]+==|SUMMARY)' \
        "$log" || true
    read -r status secs < "$logs/$target.status"
    rm -f "$logs/$target.status"
    echo "fuzz: $target ran $secs s"
    if [ "$status" -ne 0 ]; then
        echo "fuzz: $target failed (exit $status); see $log and fuzz/artifacts/$target/" >&2
        return "$status"
    fi
}

if [ -n "$runs" ]; then
    # Long runs: one target at a time.
    for target in "${targets[@]}"; do
        echo "fuzz: $target for $runs executions (commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $mode)"
        run_target "$target"
        report_target "$target"
    done
elif [ "$(nproc)" -ge ${#targets[@]} ]; then
    echo "fuzz: ${targets[*]} for $per s each, side by side ($mode)"
    pids=()
    for target in "${targets[@]}"; do
        run_target "$target" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    failed=0
    for target in "${targets[@]}"; do
        report_target "$target" || failed=$?
    done
    exit "$failed"
else
    for target in "${targets[@]}"; do
        echo "fuzz: $target for $per s ($mode)"
        run_target "$target"
        report_target "$target"
    done
fi
