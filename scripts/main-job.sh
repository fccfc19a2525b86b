#!/usr/bin/env bash
# The main job: the reference CartPole engine served through shmbridge, driven by a
# random-policy client in another process. Prints steps/s and the mean episode return.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
cargo build --release --locked --quiet
./target/release/shmbridge client --launch cartpole --num-envs 256 --steps 20000 "$@"
