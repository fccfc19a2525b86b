#!/usr/bin/env bash
# The host step of a base revision against the working tree, side by side:
#
#   bash scripts/bench-ab.sh REV [ROUNDS] [STEPS]
#
# Builds `shmbridge` and examples/step_ab.rs from REV (a `git archive` of it under
# target/bench-ab/, its own CARGO_TARGET_DIR there) and from the working tree as it is,
# uncommitted changes included. Then:
#
# 1. times the `roundtrip/null_64B` step of each (the null engine of that revision and
#    its client; batches of 100 steps after a warm-up), ROUNDS rounds (default 20) of
#    STEPS steps (default 20000), base and head back to back in every round, the order
#    swapped each round; prints medians, p99s and head/base ratios, overall and per round;
# 2. times the code of one step alone: engine and client in one thread, every wait
#    satisfied at its first look (no cache line crosses cores, nothing waits), 15 runs
#    of 200000 steps per side, interleaved; a busy machine only adds time, so the
#    smallest run of each side is the figure that survives noise;
# 3. with valgrind installed, counts the instructions of that step under callgrind
#    (exact, whatever the machine's load).
#
# The timing needs two idle cores: the pair spins, and on a loaded machine the rounds
# measure the scheduler (the load average is printed before and after; the best round of
# each side and the per-round ratios are the figures that survive some noise). The
# instruction count does not depend on the load. Nothing here is a pass/fail threshold.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust

rev=${1:?usage: scripts/bench-ab.sh REV [ROUNDS] [STEPS]}
rounds=${2:-20}
steps=${3:-20000}
base_sha=$(git rev-parse --verify "$rev^{commit}")
work=target/bench-ab
src=$work/src-${base_sha:0:12}
mkdir -p "$work"

if [ ! -d "$src" ]; then
    rm -rf "$work"/src-*
    mkdir -p "$src.tmp"
    git archive "$base_sha" | tar -x -C "$src.tmp"
    # Its own workspace, not a stray member of this checkout's (it lies under target/).
    grep -q '^\[workspace\]' "$src.tmp/Cargo.toml" || printf '\n[workspace]\n' >>"$src.tmp/Cargo.toml"
    mv "$src.tmp" "$src"
fi
# The harness of the working tree, built against the base's API; a base older than the
# harness's calls (before `Client::tensors`) keeps its own with BENCH_AB_BASE_HARNESS=1.
if [ "${BENCH_AB_BASE_HARNESS:-0}" = 1 ]; then
    git show "$base_sha:examples/step_ab.rs" >"$src/examples/step_ab.rs"
else
    cp examples/step_ab.rs "$src/examples/step_ab.rs"
fi
echo "bench-ab: building base ${base_sha:0:12} ($(git log -1 --format=%s "$base_sha" | cut -c1-60))" >&2
(cd "$src" && CARGO_TARGET_DIR="$PWD/../base-target" cargo build -q --release --bin shmbridge --example step_ab)
echo "bench-ab: building the working tree" >&2
cargo build -q --release --bin shmbridge --example step_ab

base=$work/base-target/release
head=target/release
out=$work/run
rm -rf "$out" && mkdir -p "$out"

load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "bench-ab: $rounds rounds of $steps steps per side; load average $(load)" >&2
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order="base head"; else order="head base"; fi
    for side in $order; do
        if [ "$side" = base ]; then dir=$base; else dir=$head; fi
        "$dir/examples/step_ab" time "$dir/shmbridge" "$steps" >>"$out/$side.txt"
    done
done
load_after=$(load)

echo
echo "## Step A/B: ${base_sha:0:12} (base) against the working tree (head)"
echo
echo "\`bash scripts/bench-ab.sh $rev $rounds $steps\`: roundtrip/null_64B, $rounds interleaved"
echo "rounds of $steps timed steps per side (batches of 100), $(nproc) CPUs, load average"
echo "$(echo "$load_after" | cut -d' ' -f1) at the end (1, 5, 15 min: $load_after)."
echo
"$head/examples/step_ab" report "$out/base.txt" "$out/head.txt"

for ((r = 0; r < 15; r++)); do
    for side in base head; do
        if [ "$side" = base ]; then dir=$base; else dir=$head; fi
        "$dir/examples/step_ab" cost 200000 >>"$out/$side-cost.txt"
    done
done
stats() { sort -n "$1" | awk '{v[NR] = $1} END {printf "%s %s", v[1], v[int((NR + 1) / 2)]}'; }
read -r cb_min cb_med <<<"$(stats "$out/base-cost.txt")"
read -r ch_min ch_med <<<"$(stats "$out/head-cost.txt")"
echo
echo "The code of one step alone (engine and client in one thread, no wait; 15 interleaved"
echo "runs of 200000 steps per side): base $cb_min ns (median run $cb_med), head $ch_min ns"
echo "(median run $ch_med), head/base of the fastest runs" \
    "$(awk -v a="$ch_min" -v b="$cb_min" 'BEGIN {printf "%.3f", a / b}')."

if command -v valgrind >/dev/null 2>&1; then
    count() {
        # Instructions of one step: two runs of different lengths, differenced, so
        # start-up and shutdown cancel out.
        local exe=$1 a b
        a=$(cg "$exe" 2000)
        b=$(cg "$exe" 12000)
        echo $(((b - a) / 10000))
    }
    cg() {
        valgrind --tool=callgrind --callgrind-out-file="$out/cg.out" "$1" count "$2" \
            >/dev/null 2>&1
        awk '/^(summary|totals):/ {print $2; exit}' "$out/cg.out"
    }
    ib=$(count "$base/examples/step_ab")
    ih=$(count "$head/examples/step_ab")
    echo
    echo "Instructions per step (callgrind; engine and client in one thread, no wait):"
    echo "base $ib, head $ih, head/base $(awk -v a="$ih" -v b="$ib" 'BEGIN {printf "%.3f", a / b}')."
else
    echo
    echo "(valgrind not installed: no instruction count.)"
fi
