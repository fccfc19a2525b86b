#!/usr/bin/env bash
# Soak for MINUTES (default 1): random steps, resets, calls, client re-attaches and engine
# restarts (closed, SIGTERM, SIGKILL) across processes on `null` and `cartpole`, every step
# checked (examples/soak.rs says how); RSS, descriptors and the run's regions in /dev/shm
# sampled after a warm-up and at the end must be flat, and nothing may be left.
#   bash scripts/soak.sh 10        # the figures in docs/reliability.md
# As root it runs in a private /dev/shm (scripts/lib.sh with_private_shm), apart from other
# users' regions; elsewhere in the shared one, counting only its own regions.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
minutes="${1:-1}"

cargo build --locked --release --quiet --bin shmbridge --example soak
soak=target/release/examples/soak
echo "soak: $minutes min"
with_private_shm "$soak" "$minutes"
