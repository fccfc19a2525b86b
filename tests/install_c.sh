#!/usr/bin/env bash
# Checks of scripts/install-c.sh that scripts/test.sh runs after its own install (the CMake
# build folder is then current, so each install here is a copy):
#  1. a relative prefix is the caller's directory's, not the checkout's;
#  2. a missing tool stops the script with its name and the command that installs it,
#     and nothing is installed from the package manager (apt-get and sudo are stand-ins
#     that record a call) unless --install-deps is given;
#  3. (as root) a run under sudo refuses to build as root, before building anything.
set -euo pipefail
# Run under sudo (as scripts/test.sh may be), the cases below are the tests' user's.
unset SUDO_USER
root=$(cd "$(dirname "$0")/.." && pwd)
script=$root/scripts/install-c.sh
work=$(mktemp -d)
name=install-c-check-$$
trap 'rm -rf "$work" "${root:?}/$name"' EXIT
fail() { echo "install_c.sh: FAILED: $*" >&2; exit 1; }

# 1. From another directory, a relative prefix.
mkdir "$work/caller"
(cd "$work/caller" && bash "$script" "$name/prefix" >/dev/null)
[ -f "$work/caller/$name/prefix/include/shmbridge.h" ] ||
    fail "a relative prefix was not installed under the caller's directory"
[ ! -e "$root/$name" ] || fail "a relative prefix was installed inside the checkout ($root/$name)"
echo "ok: a relative prefix is the caller's"

# 2. No cmake or pkg-config on PATH: every other command of PATH, and apt-get and sudo
# stand-ins that record being called.
bin=$work/bin
mkdir "$bin"
IFS=: read -ra dirs <<< "$PATH"
for dir in "${dirs[@]}"; do
    [ -d "$dir" ] || continue
    for f in "$dir"/*; do
        tool=${f##*/}
        case "$tool" in cmake | pkg-config | apt-get | apt | sudo) continue ;; esac
        [ -x "$f" ] && [ ! -e "$bin/$tool" ] && ln -s "$f" "$bin/$tool"
    done
done
for tool in apt-get sudo; do
    printf '#!/bin/sh\necho "%s $*" >> "%s"\nexit 1\n' "$tool" "$work/called" > "$bin/$tool"
    chmod +x "$bin/$tool"
done
set +e
out=$(cd "$work/caller" && PATH=$bin bash "$script" "$work/missing" 2>&1)
status=$?
set -e
[ "$status" -ne 0 ] || fail "installed with no cmake on PATH"
[ ! -e "$work/called" ] || fail "ran the package manager unasked: $(cat "$work/called")"
case "$out" in *"missing: cmake pkg-config"*) ;; *) fail "did not name what is missing: $out" ;; esac
case "$out" in *"apt-get install cmake pkg-config"*"--install-deps"*) ;; *) fail "no command to install them: $out" ;; esac
[ ! -e "$work/missing" ] || fail "made the prefix though it stopped"
echo "ok: missing tools are named, nothing is installed unasked"

# 3. Under sudo (as root, with SUDO_USER set): refused before the build.
if [ "$(id -u)" = 0 ]; then
    set +e
    out=$(cd "$work/caller" && SUDO_USER=nobody bash "$script" "$work/sudo" 2>&1)
    status=$?
    set -e
    [ "$status" -ne 0 ] || fail "built and installed as root under sudo"
    case "$out" in *"run it as nobody instead"*) ;; *) fail "did not say to run it as the user: $out" ;; esac
    [ ! -e "$work/sudo" ] || fail "installed under sudo"
    echo "ok: a run under sudo is refused before it builds"
else
    echo "skipped: the sudo check needs root (it sets SUDO_USER as sudo would)"
fi
