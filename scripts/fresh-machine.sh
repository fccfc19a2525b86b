#!/usr/bin/env bash
# The README's two commands on a machine that has never seen the project: a minimal
# Debian 12 root file system (debootstrap --variant=minbase, plus ca-certificates), with
# the one thing a user must bring, this machine's Rust toolchain (rustup's default
# toolchain, nothing else of ~/.cargo or ~/.rustup), and a fresh clone of the committed
# HEAD (or REV). In it the main job and the test command run as the README writes them,
# one after the other in that one clone, and their wall times are printed.
#
#   bash scripts/fresh-machine.sh [--rev REV] [--steps main,tests,install] [--keep]
#
# --steps runs the README's commands in the order given, in the one clone (e.g.
# tests,main,main,tests: either order, each twice). `install` runs the README's Install
# section as written (its sh blocks, in one shell: the venv, `pip install .`, the wheel
# built and installed) and then its Quickstart's python block with that venv's python;
# it needs Python, which the main job or the tests install first.
#
# The root file system is cached in target/fresh-machine/base (made once, with
# debootstrap from Debian's archive); each run copies it anew to target/fresh-machine/root,
# so nothing installed by an earlier run is there. The "machine" is that root in mount,
# PID and UTS namespaces of its own (unshare): its own /proc, /dev/shm (as large as this
# machine's), /tmp and /run, so the tests find their peers in /proc and can make private
# mounts of their own (its root is the mount namespace's root, pivot_root, as on a
# machine). It shares this
# machine's network (the package registries) and kernel. Root only.
#
# Exit status: 0 when both commands passed; otherwise the first failure's. The logs are in
# target/fresh-machine/*.log.
# One block, parsed whole before it runs: editing this file while it runs changes nothing.
{
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rev=HEAD
steps=main,tests,install
keep=""
while [ $# -gt 0 ]; do
    case "$1" in
        --rev) rev="${2:?--rev needs a revision}"; shift 2 ;;
        --steps) steps="${2:?--steps needs a list of main and tests}"; shift 2 ;;
        --keep) keep=1; shift ;;
        *) echo "usage: bash scripts/fresh-machine.sh [--rev REV] [--steps main,tests,install] [--keep]" >&2; exit 2 ;;
    esac
done
IFS=, read -ra step_list <<< "$steps"
for s in "${step_list[@]}"; do
    case "$s" in
        main | tests | install) ;;
        *) echo "fresh-machine: unknown step '$s' (main, tests, install)" >&2; exit 2 ;;
    esac
done
if [ "$(id -u)" != 0 ]; then
    echo "fresh-machine: needs root (debootstrap, mount and PID namespaces)" >&2
    exit 2
fi

work=$repo/target/fresh-machine
base=$work/base
root=$work/root
mkdir -p "$work"

if ! command -v debootstrap >/dev/null 2>&1; then
    echo "fresh-machine: installing debootstrap (Debian's package), which makes the root file system"
    apt-get update -q >/dev/null
    apt-get install -y -q debootstrap >/dev/null
fi
if [ ! -e "$base/.complete" ]; then
    echo "fresh-machine: making a minimal Debian 12 root file system in $base (once; cached)"
    rm -rf "$base"
    # From the Debian archive this machine's apt uses, with its apt sources.
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$mirror" ] || { echo "fresh-machine: no Debian archive in this machine's apt sources" >&2; exit 1; }
    debootstrap --variant=minbase --include=ca-certificates bookworm "$base" "$mirror" \
        > "$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log" >&2; echo "fresh-machine: debootstrap failed (above)" >&2; exit 1; }
    if [ -e /etc/apt/sources.list.d/debian.sources ]; then
        rm -f "$base/etc/apt/sources.list"
        cp /etc/apt/sources.list.d/debian.sources "$base/etc/apt/sources.list.d/"
    fi
    rm -rf "$base/var/cache/apt/archives/"*.deb
    touch "$base/.complete"
fi

# A fresh copy of the base: nothing of an earlier run survives.
cleanup() {
    if [ -z "$keep" ]; then rm -rf "$root"; fi
}
trap cleanup EXIT
rm -rf "$root"
cp -a "$base" "$root"
rm -f "$root/.complete"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# Its name, resolvable as Debian's installer makes it (torchrun's rendezvous looks it up).
echo fresh-machine > "$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tfresh-machine\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
    > "$root/etc/hosts"
# This machine's network trust, as any machine here has it: its local CA certificates
# (a registry's TLS may be re-signed by one) and pip's configuration of them.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates > "$work/ca.log" 2>&1
fi
[ ! -e /etc/pip.conf ] || cp /etc/pip.conf "$root/etc/pip.conf"
ca_env=()
for v in SSL_CERT_FILE SSL_CERT_DIR PIP_CERT REQUESTS_CA_BUNDLE CURL_CA_BUNDLE GIT_SSL_CAINFO; do
    [ -z "${!v:-}" ] || ca_env+=("$v=${!v}")
done

# The Rust toolchain: rustup and its default toolchain (hard links: same disk, no copy),
# as rustup would have installed them; an empty cargo registry.
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
toolchain=$(rustup default | awk '{print $1}')
tc_dir=$(readlink -f "$rustup_home/toolchains/$toolchain")
mkdir -p "$root/root/.rustup/toolchains" "$root/root/.cargo/bin"
cp -al "$tc_dir" "$root/root/.rustup/toolchains/$toolchain"
printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "default"\nauto_self_update = "disable"\n' \
    "$toolchain" > "$root/root/.rustup/settings.toml"
cp "$cargo_home/bin/rustup" "$root/root/.cargo/bin/rustup"
for proxy in cargo rustc rustdoc cargo-clippy clippy-driver cargo-fmt rustfmt rust-gdb rust-lldb; do
    ln -f "$root/root/.cargo/bin/rustup" "$root/root/.cargo/bin/$proxy"
done
printf 'export PATH="$HOME/.cargo/bin:$PATH"\n' > "$root/root/.cargo/env"
echo '. "$HOME/.cargo/env"' >> "$root/root/.profile"

# The fresh clone of the committed revision.
sha=$(git rev-parse --verify "$rev^{commit}")
git clone -q --no-local "$repo" "$root/root/shmbridge"
git -C "$root/root/shmbridge" checkout -q "$sha"
echo "fresh-machine: Debian $(cat "$root/etc/debian_version") (minbase), $($cargo_home/bin/rustc --version), a clone of ${sha:0:12} ($(git log -1 --format=%s "$sha" | cut -c1-60))"

# The README's two commands, as it writes them: the check fails if the README says
# something else, so what runs here is what a newcomer pastes.
main_cmd="bash scripts/main-job.sh"
test_cmd="bash scripts/test.sh"
for c in "$main_cmd" "$test_cmd"; do
    if ! grep -qF -- "$c" "$root/root/shmbridge/README.md"; then
        echo "fresh-machine: README.md no longer says \`$c\`: update this script with it" >&2
        exit 2
    fi
done

# The README's Install and Quickstart sections as a script (the `install` step).
python3 - "$root/root/shmbridge/README.md" > "$root/root/readme-install.sh" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def section(title):
    m = re.search(r"^## " + title + r"\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        sys.exit(f"README.md has no '## {title}' section")
    return m.group(1)
blocks = lambda body, lang: re.findall(r"^```" + lang + r"\n(.*?)^```", body, re.S | re.M)
install, quick = blocks(section("Install"), "sh"), blocks(section("Quickstart"), "python")
if not install or len(quick) != 1:
    sys.exit("README.md: expected sh blocks under Install and one python block under Quickstart")
print("set -euxo pipefail")
for b in install:
    print(b, end="")
print("python - <<'QUICKSTART'\n" + quick[0] + "QUICKSTART")
PY

shm_kib=$(df -k --output=size /dev/shm | tail -n1 | tr -d ' ')

# `machine CMD`: runs CMD (a bash command line) as root in /root/shmbridge of the fresh
# machine, with a login environment and nothing of this one's but its CA-bundle variables
# (no pip, cargo or Python settings).
machine() {
    unshare --mount --pid --uts --fork --propagation private --kill-child \
        env ROOT="$root" SHM_KIB="$shm_kib" CMD="$1" CI_FLAG="${CI:-}" CA_ENV="${ca_env[*]}" sh -c '
        set -e
        mount --bind "$ROOT" "$ROOT"
        mount -t proc proc "$ROOT/proc"
        mount -t sysfs sysfs "$ROOT/sys" 2>/dev/null || mount --rbind /sys "$ROOT/sys"
        mount --rbind /dev "$ROOT/dev"
        mount -t tmpfs -o "size=${SHM_KIB}k,mode=1777" shm "$ROOT/dev/shm"
        mount -t tmpfs -o mode=1777 tmp "$ROOT/tmp"
        mount -t tmpfs -o mode=755 run "$ROOT/run"
        hostname fresh-machine
        # pivot_root, not chroot: the root file system becomes the mount namespace'"'"'s
        # root, as on a machine, so paths the kernel prints (/proc/PID/exe of a process
        # in a namespace of its own) are the same from every namespace.
        cd "$ROOT"
        mkdir -p .old-root
        pivot_root . .old-root
        exec /usr/sbin/chroot . /bin/sh -c '"'"'umount -l /.old-root && rmdir /.old-root && exec "$@"'"'"' sh \
            /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
            PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            ${CI_FLAG:+CI=$CI_FLAG} $CA_ENV \
            /bin/bash -c "cd /root/shmbridge && $CMD"'
}

status=0
run_timed() {
    local name=$1 cmd=$2 start secs rc=0
    echo "fresh-machine: \$ $cmd   (log: target/fresh-machine/$name.log)"
    start=$SECONDS
    machine "$cmd" < /dev/null > "$work/$name.log" 2>&1 || rc=$?
    secs=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        echo "fresh-machine: PASSED in ${secs} s ($((secs / 60)) min $((secs % 60)) s): $cmd"
        tail -n 3 "$work/$name.log" | sed 's/^/   | /'
    else
        echo "fresh-machine: FAILED (status $rc) after ${secs} s: $cmd; its last lines:"
        tail -n 40 "$work/$name.log" | sed 's/^/   | /'
        [ "$status" -ne 0 ] || status=$rc
    fi
}
n=0
for s in "${step_list[@]}"; do
    n=$((n + 1))
    case "$s" in
        main) run_timed "$n-main-job" "$main_cmd" ;;
        tests) run_timed "$n-test" "$test_cmd" ;;
        install) run_timed "$n-readme-install" "bash /root/readme-install.sh" ;;
    esac
done
exit "$status"
}
