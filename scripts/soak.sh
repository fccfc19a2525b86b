#!/usr/bin/env bash
# Soak for MINUTES (default 1): random steps, resets, calls, client re-attaches and engine
# restarts (closed, SIGTERM, SIGKILL) across processes on `null` and `cartpole`, every step
# checked (examples/soak.rs says how); RSS, descriptors and the run's regions in /dev/shm
# sampled after a warm-up and at the end must be flat, and nothing may be left.
#   bash scripts/soak.sh 10        # the figures in docs/reliability.md
# It runs in a region namespace of its own (SHMBRIDGE_NAMESPACE, docs/protocol.md 1.1):
# its engines' start-up sweeps see only its regions, and nobody else's sweep sees them.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
minutes="${1:-1}"

cargo build --locked --release --quiet --bin shmbridge --example soak
echo "soak: $minutes min"
SHMBRIDGE_NAMESPACE="${SHMBRIDGE_NAMESPACE:-soak}_$$" target/release/examples/soak "$minutes"
