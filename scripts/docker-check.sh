#!/usr/bin/env bash
# Runs the Docker commands of docs/deployment.md as written, on this machine:
#
#   bash scripts/docker-check.sh [WHEEL]
#
# Needs root. Installs Debian's docker.io and debootstrap if missing, starts a private
# dockerd (its own data root and socket under target/docker-check/, vfs storage, no
# bridge: nothing is pulled from a registry, and nothing listens on the network) and
# builds the image IMAGE of the page from a minimal Debian (debootstrap, with python3 and
# numpy from Debian: NumPy 1.24, the oldest the package supports) and the wheel WHEEL
# (default: scripts/build-wheel.sh builds one). Then, each checked:
#
# 1. the page's two commands: an engine container (`--ipc=shareable --shm-size=2g --init
#    --user 1000:1000`) and a learner container (`--ipc=container:sim --network=none`)
#    running a train.py that steps 1000 times; the engine reports the client's close;
# 2. a third container owning the IPC namespace (`--ipc=container:shm` for both):
#    `docker stop` of the engine (SIGTERM through --init): the learner gets
#    EngineClosedError, the engine exits 143, /dev/shm is empty;
# 3. `shmbridge ls` from yet another container sees the live region;
# 4. `docker kill` of the learner: the engine says the client died, naming it as a
#    process of another PID namespace, and exits; /dev/shm is empty;
# 5. `docker kill -s INT` of the learner (Ctrl-C): it closes (exit 130), the engine ends
#    normally.
#
# Not in CI (a CI machine need not run a Docker daemon); the same cases run there with
# `unshare` (tests/containers.rs, tests/python/test_containers.py).
#
#   bash scripts/docker-check.sh --emulate [WHEEL]
#
# Without a Docker daemon (a machine with none, or where none may run): runs the files of
# examples/deploy as written, their containers emulated with `unshare` namespaces (each
# its own PID, network and mount namespaces and /proc, all one tmpfs as /dev/shm, as the
# file's user): the Compose file's services and the Kubernetes Job's containers, each
# twice (the engine first; the learner first, which must wait for the engine). The
# image is emulated by a Debian Python venv with the wheel installed and the
# Dockerfile's WORKDIR and COPYs; scripts/deploy_check.py says what is real and what is
# emulated. About 10 s after the wheel is built.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ "${1:-}" = --emulate ]; then
    # Outside the checkout: the containers run as the files' user, who cannot reach a
    # checkout under a home folder of mode 0700 (root's, on a fresh Debian machine).
    work=$(mktemp -d "${TMPDIR:-/tmp}/shmbridge-deploy-check.XXXXXX")
    chmod 755 "$work"
    trap 'rm -rf "$work"' EXIT
    wheel=${2:-}
    if [ -z "$wheel" ]; then
        bash scripts/build-wheel.sh --out "$work/dist"
        wheel=$(ls "$work"/dist/shmbridge-*.whl)
    fi
    # The image's Python: Debian's (readable by the containers' user, unlike a
    # toolchain under /root), with the wheel and PyYAML to read the files.
    [ -x /usr/bin/python3 ] || apt_install python3
    /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
    rm -rf "$work/venv" "$work/image"
    /usr/bin/python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q "$wheel" pyyaml
    # Its own mount namespace: the check mounts a tmpfs per file on /dev/shm.
    status=0
    unshare --mount --propagation private "$work/venv/bin/python" scripts/deploy_check.py \
        examples/deploy "$work/image" "$work/venv/bin" || status=$?
    exit "$status"
fi

command -v dockerd >/dev/null 2>&1 || apt_install docker.io
command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap

work=$PWD/target/docker-check
mkdir -p "$work"
wheel=${1:-}
if [ -z "$wheel" ]; then
    bash scripts/build-wheel.sh --out "$work/dist"
    wheel=$(ls "$work"/dist/shmbridge-*.whl)
fi

sock=$work/docker.sock
D() { docker -H "unix://$sock" "$@"; }
dockerd --data-root "$work/data" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" \
    -H "unix://$sock" --storage-driver vfs --iptables=false --ip-masq=false --bridge=none \
    >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
cleanup() {
    D rm -f sim learner shm >/dev/null 2>&1 || true
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 300); do
    D version >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { cat "$work/dockerd.log" >&2; exit 1; }
    sleep 0.1
done

rootfs=$work/rootfs
if [ ! -x "$rootfs/usr/bin/python3" ]; then
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-numpy,python3-pip \
        bookworm "$rootfs" http://deb.debian.org/debian >"$work/debootstrap.log"
fi
cp "$wheel" "$rootfs/tmp/"
chroot "$rootfs" sh -c 'pip install -q --no-deps --force-reinstall --break-system-packages \
    /tmp/shmbridge-*.whl 2>&1 | grep -v "Running pip as the .root. user" || true; rm /tmp/shmbridge-*.whl'
cat >"$rootfs/train.py" <<'EOF'
"""The learner of docs/deployment.md: attaches to "demo", steps 1000 times, closes."""
import numpy as np
import shmbridge

with shmbridge.attach("demo", timeout=30) as client:
    n_actions = client.actions.shape
    rng = np.random.default_rng(0)
    for _ in range(1000):
        client.step(rng.integers(0, 2, size=n_actions))
    print("train.py: 1000 steps of", n_actions[0], "envs", flush=True)
EOF
cat >"$rootfs/learn_forever.py" <<'EOF'
"""Steps "demo" until the engine goes away; says how it ended."""
import sys
import shmbridge

with shmbridge.attach("demo", timeout=30) as client:
    print("attached", flush=True)
    steps = 0
    try:
        while True:
            client.step()
            steps += 1
    except shmbridge.errors.ShmBridgeError as e:
        print(f"after {steps} steps: {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
EOF
IMAGE=shmbridge-deployment-check:latest
tar -C "$rootfs" -c . | D import - "$IMAGE" >/dev/null

fail() { echo "docker-check: FAILED: $*" >&2; exit 1; }
shm_listing() { D exec shm sh -c 'ls -A /dev/shm'; }
wait_attached() {
    for _ in $(seq 300); do
        D logs learner 2>&1 | grep -q attached && return 0
        sleep 0.1
    done
    fail "the learner never attached: $(D logs learner 2>&1)"
}
engine() {
    D run -d --name sim "$@" --init --user 1000:1000 \
        "$IMAGE" shmbridge engine --env cartpole --num-envs 256 --name demo --idle-timeout 3600 >/dev/null
}

# An engine and a learner that steps until it ends, both in the IPC namespace of `shm`;
# returns once the learner is attached.
engine_and_learner() {
    engine --ipc=container:shm
    D run -d --name learner --ipc=container:shm --init --user 1000:1000 --network=none \
        "$IMAGE" python3 /learn_forever.py >/dev/null
    wait_attached
}
# Nothing left in /dev/shm; the containers of the last case removed.
shm_empty() {
    [ -z "$(shm_listing)" ] || fail "left in /dev/shm: $(shm_listing)"
    D rm -f sim learner >/dev/null
}

echo "== 1. the page's commands: engine with --ipc=shareable, learner with --ipc=container:sim"
D run -d --name sim --ipc=shareable --shm-size=2g --init --user 1000:1000 \
    "$IMAGE" shmbridge engine --env cartpole --num-envs 256 --name demo --idle-timeout 3600 >/dev/null
out=$(D run --rm --ipc=container:sim --init --user 1000:1000 --network=none "$IMAGE" python3 /train.py)
echo "$out"
[ "$out" = "train.py: 1000 steps of 256 envs" ] || fail "train.py said: $out"
[ "$(D wait sim)" = 0 ] || fail "engine: $(D logs sim 2>&1)"
D logs sim 2>&1 | grep -q "client closed after 1000 steps" || fail "engine: $(D logs sim 2>&1)"
D rm -f sim >/dev/null

echo "== 2. a third container owns /dev/shm; docker stop of the engine"
D run -d --name shm --ipc=shareable --shm-size=2g "$IMAGE" sleep infinity >/dev/null
engine_and_learner
echo "== 3. shmbridge ls from a fourth container"
D run --rm --ipc=container:shm --user 1000:1000 --network=none "$IMAGE" shmbridge ls \
    | tee "$work/ls.txt"
grep -q "^shmbridge-demo .* attached " "$work/ls.txt" || fail "ls did not show the live region"
start=$(date +%s%N)
D stop sim >/dev/null
echo "docker stop took $(( ($(date +%s%N) - start) / 1000000 )) ms"
[ "$(D wait sim)" = 143 ] || fail "engine exit status: $(D inspect sim --format '{{.State.ExitCode}}')"
[ "$(D wait learner)" = 3 ] || fail "learner: $(D logs learner 2>&1)"
D logs learner 2>&1 | tail -1
D logs learner 2>&1 | grep -q "EngineClosedError" || fail "learner: $(D logs learner 2>&1)"
shm_empty

echo "== 4. docker kill of the learner"
engine_and_learner
D kill learner >/dev/null
[ "$(D wait sim)" = 1 ] || fail "engine: $(D logs sim 2>&1)"
D logs sim 2>&1 | tail -1
D logs sim 2>&1 | grep -q "in another PID namespace) died" || fail "engine: $(D logs sim 2>&1)"
shm_empty

echo "== 5. Ctrl-C (SIGINT) to the learner"
engine_and_learner
D kill -s INT learner >/dev/null
[ "$(D wait learner)" = 130 ] || fail "learner: $(D logs learner 2>&1)"
[ "$(D wait sim)" = 0 ] || fail "engine: $(D logs sim 2>&1)"
D logs sim 2>&1 | tail -1
shm_empty
echo "docker-check: all passed"
