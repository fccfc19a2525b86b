#!/usr/bin/env bash
# The round-trip benchmark with the C engine's cases: builds the C library in release
# mode (capi/), compiles examples/c/null_engine.c against it, and runs
# `cargo bench --bench roundtrip` with SHMBRIDGE_BENCH_C_ENGINE set, so the C engine's
# round trip is measured next to the Rust engine's and the raw floor, in one run, and the
# summary prints their ratios. Arguments go to cargo bench (e.g. -- --quick);
# SHMBRIDGE_BENCH_QUICK=1 makes it a smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
# The features of the library as installed (scripts/install-c.sh): the same build.
cargo build --locked --release -q -p shmbridge-capi --features cuda
lib=$PWD/target/release
mkdir -p target/release/c
cc -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -Werror -Iinclude examples/c/null_engine.c \
    -L"$lib" -Wl,-rpath,"$lib" -lshmbridge -o target/release/c/null_engine
SHMBRIDGE_BENCH_C_ENGINE=$PWD/target/release/c/null_engine cargo bench --locked --bench roundtrip "$@"
